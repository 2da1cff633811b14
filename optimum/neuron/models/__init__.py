"""Static-shape decoder modules per model family."""
