"""Many runs: a study's spec, its store, the workers that fill it and the ``fastcifar sweep``
command (docs/sweeps.md). Above the commands: a worker trains through the Python API."""
