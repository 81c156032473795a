"""The RAM / RAM+ mathematics and input rules: torch only, no mergekit, no click."""
