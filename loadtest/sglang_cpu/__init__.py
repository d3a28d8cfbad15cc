"""Real SGLang 0.5.23 servers on the CPU with a tiny local model (issue 11).

- :mod:`.env`: the machine-level cache (the venv of ``tools/sglang_cpu/install.sh`` and
  the tiny model), built on first use.
- :mod:`.model`: the tiny model builder (runs inside the SGLang venv).
- :mod:`.kimi_model`, :mod:`.tokenization_kimi`: its twin with the tokenizer in Kimi K2's
  TikToken form (``tiktoken.model`` + a ``trust_remote_code`` class written here;
  ``kvgate sglang-cpu --tokenizer tiktoken``), for precise mode's proof against the engine.
- :mod:`.server`: launch command, environment, start/stop of one server's process tree.
- :mod:`.cli`: ``kvgate sglang-cpu``.
- :mod:`.harness`: ``--engine sim|sglang-cpu``, ``--api``, ``--replica-url`` of ``kvgate
  loadtest sweep`` and ``kvgate bench peers``, and the workload scaling to the tiny model.

``python -m loadtest.calibrate`` compares the simulated ``tiny-cpu`` replica with a real
server request by request (docs/results-sglang-cpu.md).
"""
