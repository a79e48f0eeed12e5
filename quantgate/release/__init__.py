"""The release: its spec, the steps the flow composes, the judge step, the ladder, the registry and run records."""
