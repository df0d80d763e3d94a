"""Dev tooling, apart from the server's core: the local vLLM CPU engine (`tokenkeep engine`),
`tokenkeep demo` and its GRPO loop (`demo --train`). Nothing in the server imports it."""
