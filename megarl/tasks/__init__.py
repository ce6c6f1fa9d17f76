"""The built-in tasks, one file each: its prompts, its demonstrations for ``megarl train-lm``,
and its verifier or environment. Used when ``data.train_files`` is empty (``data.task``, :mod:`megarl.tasks.registry`).
Nothing is imported here: a reward worker loads a verifier from its task's file without torch."""
