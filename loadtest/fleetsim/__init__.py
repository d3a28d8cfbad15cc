"""Fleet simulation in virtual time: real policies + real index + simulated replicas.

``kvgate simulate`` (loadtest/simulate_cmd.py) is the command; see README.md here.
Modules: ``prompts`` (trace turns -> hashes, token ids), ``router`` (the gateway's
routing path), ``sessions`` (when requests are sent), ``run`` (one policy over a
workload), ``oracle`` (the upper bound), ``metrics`` (summary fields), ``table``.
"""
