"""Reproductions of the papers' results, each a script that runs the main job and writes tables and plots."""
