"""What the release targets: hardware profiles, a model's shape and weight bytes, and the model catalogue."""
