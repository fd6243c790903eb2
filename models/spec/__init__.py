"""The SemanticSpec algorithm: ``rules`` holds its acceptance rule, one pure function."""
