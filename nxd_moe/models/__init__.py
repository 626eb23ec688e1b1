"""Whole-model integration: transformers models running nxd_moe layers, built, patched and traced."""
