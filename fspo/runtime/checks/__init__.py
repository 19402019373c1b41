"""The up-front checks of a launch and how user errors are shown: the top layer of fspo.runtime."""
