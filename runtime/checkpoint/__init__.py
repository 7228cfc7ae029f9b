"""A job's weights in and out: sharded checkpoints and their format, load_pretrained, init_weights."""
