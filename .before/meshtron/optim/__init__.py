"""meshtron.optim"""
