"""Real SGLang 0.5.23 servers on the CPU with a tiny local model (issue 11).

- :mod:`.env`: the machine-level cache (the venv of ``tools/sglang_cpu/install.sh`` and
  the tiny model), built on first use.
- :mod:`.model`: the tiny model builder (runs inside the SGLang venv).
- :mod:`.server`: launch command, environment, start/stop of one server's process tree.
- :mod:`.cli`: ``kvgate sglang-cpu``.
"""
