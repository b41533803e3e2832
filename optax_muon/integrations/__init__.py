"""Adapters to the trainers JAX users run: each imports its trainer only when
used, and takes the trainer's own config, mesh and wrappers."""
