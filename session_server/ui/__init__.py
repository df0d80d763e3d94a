"""Static files of the rollout viewer (served by session_server.api.viewer)."""
