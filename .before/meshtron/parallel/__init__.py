"""meshtron.parallel"""
