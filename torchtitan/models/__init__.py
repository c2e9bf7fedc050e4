"""Model families the trainer can build."""
