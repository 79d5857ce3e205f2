mod common;
#[test]
fn dump() {
    let mut names: Vec<_> = std::fs::read_dir(common::data_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    for n in names {
        let d = common::read(&n);
        match unshard_pickle::parse(&d) {
            Ok(p) => println!(
                "{n}: {}\n   describe: {}",
                common::render(&p),
                p.describe(p.root())
            ),
            Err(e) => println!("{n}: ERR {e}"),
        }
    }
}
