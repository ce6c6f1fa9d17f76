# The README's two commands. Each creates .venv on first use (scripts/bootstrap.sh).
.PHONY: demo test test-fast venv

venv:
	@scripts/bootstrap.sh

# Command one: the main job on this machine (CPU demo by default; extra args: ARGS="key=value ...").
demo: venv
	.venv/bin/megarl train configs/grpo_demo.yaml $(ARGS)

# Command two: the test suite (multi-process Megatron on CPU included).
test: venv
	.venv/bin/python -m pytest tests $(ARGS)

# Unit tests only (seconds).
test-fast: venv
	.venv/bin/python -m pytest tests/unit $(ARGS)
