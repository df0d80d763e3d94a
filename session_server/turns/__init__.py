"""The turn core: the one place that decides what a request continues, what prompt the
engine gets and what is stored. `service.TurnService` is where a turn starts; the modules
beside it each hold one part of it (see `service`'s docstring)."""
