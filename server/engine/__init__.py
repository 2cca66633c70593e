"""The engine process: every served model loaded once, and the loop that decodes them."""
