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

# Command two: the test suite (multi-process Megatron on CPU included). TEST_WORKERS=2 runs it in
# two pytest-xdist workers, one test file each at a time (--dist loadfile keeps a file's shared
# torchrun, Ray and engine sessions in one worker); measured on 2 cores it took as long as one
# process (65 min) and its doubled load made two deadline-bound cases fail, so the default is one.
TEST_WORKERS ?= 0
test: venv
	.venv/bin/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# Unit tests only (seconds).
test-fast: venv
	.venv/bin/python -m pytest tests/unit $(ARGS)
