"""GPT data pipeline: mmap indexed datasets, packed/shuffled GPT samples, blending and samplers.

Importing this package is cheap (no torch): tools/preprocess_data.py only needs indexed_dataset.
"""
