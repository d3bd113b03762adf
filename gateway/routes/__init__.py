"""One router module per resource: jobs, batches, models, health, and the OpenAI-compatible completions and
chat routes. Routes stay thin: they declare the HTTP shape and delegate to the gateway's modules."""
