from app.main import run

run()
