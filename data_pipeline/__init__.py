"""K3's multimodal data pipeline: curation (datatrove steps) from raw text, image-text and video
to packed Megatron shards with a manifest (`k3-data`, pipeline.run_pipeline), and the training
loader (loader.K3DataLoader). DESIGN.md section 2 lists what this package may import."""
