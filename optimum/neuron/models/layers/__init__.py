"""Building blocks of the static decoders."""
