"""Running a step: the model runner, input preparation, CUDA graphs and the attention backends."""
