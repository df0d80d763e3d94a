"""tokenkeep's Kubernetes operator: ModelServer and SessionServer custom resources."""
