"""After the decision: the registry of promoted entries (`registry`, its file `registryfile`), the copies of an entry
at publish targets (`targets`, `publish`), the signed decision webhook (`webhook`) and the MLflow export
(`mlflow_*`). None of it imports the release run: it reads a finished run's files."""
