"""paraflex.models: model architectures (the built-in catalog, HF config.json and GGUF headers) and the sizes derived from them."""
