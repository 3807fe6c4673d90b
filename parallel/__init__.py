"""Process groups, the device mesh layout, and how the model is parallelised over it."""
