fn main() {
    let path = std::env::args().nth(1).unwrap_or_default();
    let body = std::fs::read_to_string(&path).unwrap_or_default();
    let spec = engine::spec::parse(&body, engine::spec::Format::Toml);
    match spec {
        Err(e) => eprintln!("{e}"),
        Ok(spec) => {
            let t = std::time::Instant::now();
            let r = engine::simrun::run_virtual(spec);
            match r {
                Ok(s) => println!("{}\nwall {:?}", serde_json::to_string_pretty(&s.steps.last()).unwrap_or_default(), t.elapsed()),
                Err(e) => eprintln!("{e}"),
            }
        }
    }
}
