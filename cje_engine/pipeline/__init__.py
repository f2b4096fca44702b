"""prepare -> replicates -> finalize: the evaluation path from a frame to a result."""
