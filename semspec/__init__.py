"""semspec: semantic-aware speculative decoding (SemanticSpec) for reasoning LLMs."""
