"""The kvgate gateway: one OpenAI-compatible endpoint in front of a fleet of SGLang replicas."""
