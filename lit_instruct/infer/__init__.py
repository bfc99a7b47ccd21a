"""Using a trained adapter: generation, interactive chat, and evaluation on held-out records."""
