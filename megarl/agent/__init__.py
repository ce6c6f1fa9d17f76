"""Multi-turn, tool-using rollouts (agentic RL): environments, tool calls and the agent loop."""
