"""The HTTP process: the FastAPI app, its routes and the client of the engine process."""
