# The README's two commands. Each creates .venv on first use (scripts/bootstrap.sh).
.PHONY: demo agent-demo test test-fast venv

venv:
	@scripts/bootstrap.sh

# Command one: the main job on this machine: a supervised warm start of a tiny Llama, exported to
# Hugging Face, post-trained with GRPO from that directory, exported again (scripts/demo.sh;
# GRPO overrides: ARGS="key=value ...").
demo: venv
	scripts/demo.sh $(ARGS)

# The agentic demo: a tiny Llama learns to call a calculator tool with multi-turn GRPO
# (scripts/agent_demo.sh; about 4 minutes on 2 cores).
agent-demo: venv
	scripts/agent_demo.sh $(ARGS)

# Command two: the test suite (multi-process Megatron on CPU included), in two pytest workers, one
# test file each at a time (pytest-xdist --dist loadfile keeps a file's shared torchrun, Ray and
# engine sessions in one worker). About half the suite's time is spent waiting (Ray and engine
# start-ups, deadlines of the fault cases), which the second worker fills. TEST_WORKERS=0 runs it
# in one process.
TEST_WORKERS ?= 2
test: venv
	.venv/bin/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# Unit tests only (seconds).
test-fast: venv
	.venv/bin/python -m pytest tests/unit $(ARGS)
