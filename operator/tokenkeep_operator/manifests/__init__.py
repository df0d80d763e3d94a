"""Pure builders of the Kubernetes objects behind each custom resource: spec in, dicts out."""
