"""Model families, one file per Hugging Face model_type."""
