"""sanitizer."""
