"""Experiments built on compjax: the main job, data, models, reproductions and benchmarks."""
