"""Out of training: PEFT adapter folders, merged models, GGUF files and Ollama Modelfiles."""
