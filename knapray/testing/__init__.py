"""Tools that check knapray rather than train with it: the GPU check."""
