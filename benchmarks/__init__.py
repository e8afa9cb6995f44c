"""The benchmark of the postprocess on the local GPU, run from the repository root: README.md here lists its
commands and what each writes; each module's docstring says how it measures."""
