"""Tools that check knapray rather than train with it: the GPU check, chaos and elastic
runs, in-memory step batches for parity checks and benchmarks."""
