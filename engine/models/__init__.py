"""Model definitions and weight loading.

``config`` parses a Hugging Face config into ``ModelConfig``; ``llama`` is the one decoder for
the Llama family; ``loader.load_model`` turns a builtin name, a local directory or a GGUF file
into a ready model; ``builtin`` resolves builtin names to converted local directories.
Import the submodules directly.
"""
