"""Public-style Flax training programs, each on one device and with compjax added (see the README)."""
