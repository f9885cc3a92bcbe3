"""prefixkv benchmarks: workloads run on prefixkv and its peers in one process (``python -m bench``).

See ``bench/__main__.py`` for the commands and ``bench/RESULTS.md`` for measured numbers."""
