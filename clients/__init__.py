"""HTTP clients of the fleet's services: the engine (SGLang's protocol) and the router."""
