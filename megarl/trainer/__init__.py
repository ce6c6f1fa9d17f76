"""The RL loops the single controller runs, and their driver-side helpers."""
