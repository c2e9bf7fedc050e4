"""What scripts/make_assets.py builds the bundled assets from: the corpus grammar and its word lists, a portable
random generator, and the two tokenizer trainers."""
