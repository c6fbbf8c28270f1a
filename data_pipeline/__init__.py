"""K3's multimodal data pipeline: curation (datatrove steps) from raw text, image-text and video
to packed Megatron shards with a manifest (`k3-data`, pipeline.run_pipeline), and the training
loader (loader.K3DataLoader). From the model it imports only the batch layout (model.batch, the
vision patch and token counts), VisionConfig and model.errors (pyproject.toml's import
contracts check it)."""
